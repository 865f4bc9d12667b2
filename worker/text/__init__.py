"""Text around the tokens: the tokenizer, incremental detokenizing and stop strings."""
