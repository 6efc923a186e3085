"""Size limits of the data commands that their command lines quote before anything heavy is imported."""

#: data_prep/stats.py --max-text-bytes: a sample whose text parts are larger is counted as too long, not tokenized
DEFAULT_MAX_TEXT_BYTES = 1 << 20
