"""What a model folder measures on this machine: perplexity on a text, decode speed against the memory bound."""
