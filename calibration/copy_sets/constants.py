"""What the three copy sets share: the seed of their random draws and the prompt-size limits."""

SEED = "issue28-item5"  # seeds every random.Random here (string seeds hash the same in every process)
MAX_PROMPT_CHARS = 10_000
MAX_LONG_PROMPT_CHARS = 20_000
