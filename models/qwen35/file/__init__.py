"""The GGUF file format: files read and checked, described, costed, and synthetic ones written."""
