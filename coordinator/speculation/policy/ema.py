"""The exponential moving average every estimate of the K policy is kept by."""


def ema(old: float, new: float, weight: float) -> float:
    """Exponential moving average: ``weight`` on the new observation."""
    return (1.0 - weight) * old + weight * new
