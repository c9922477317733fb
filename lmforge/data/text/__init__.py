"""Raw text in: sources (local files, globs, remote objects), the built-in corpus, the tokenizer and its vocabulary extension."""
