"""One reader and one writer per foreign format; each speaks only canonical tensors."""
