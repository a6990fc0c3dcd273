"""Text in and out: the tokenizer, incremental detokenization, stop strings, chat templates, and how long a
prompt may be."""
