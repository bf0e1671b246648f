"""Weight-only quantization of exported graphs (int8, int4): the schemes, their graph passes and their bounds."""
