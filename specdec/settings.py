"""Settings shared by every service. Each field is a ``--kebab-case`` flag and a ``SPECDEC_*``
environment variable (pydantic-settings); the flag wins over the variable."""

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        cli_kebab_case=True, cli_implicit_flags=True, cli_avoid_json=True, extra="ignore"
    )

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for every interface).")
    port: int = Field(description="gRPC port.")
    log_level: str = Field("INFO", description="Python logging level.")
    max_workers: int = Field(16, description="gRPC handler threads (concurrent calls).")


def parse_settings(cls: type[ServiceSettings], args: list[str], prog: str) -> ServiceSettings:
    """Builds ``cls`` from command-line ``args`` and the environment; ``--help`` lists every field
    with its environment variable and exits."""
    return CliApp.run(cls, cli_args=args, cli_prog_name=prog, cli_show_env_vars=True)
