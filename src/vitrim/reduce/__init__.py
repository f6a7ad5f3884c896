"""Token reducers that plug into a Block: the interface (``base``) and the methods."""
