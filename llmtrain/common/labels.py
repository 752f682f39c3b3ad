"""The label of tokens that carry no loss (prompt, padding): -100, as in PyTorch and
``transformers``. A leaf: data code writes it, objectives read it, neither imports the other."""

IGNORE_INDEX = -100
