"""Model-free proposers: n-gram prompt lookup and SuffixDecoding, which draft from text already
seen instead of from a draft model."""
