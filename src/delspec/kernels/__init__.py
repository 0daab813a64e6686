"""How products are computed: products on GGUF blocks as stored (`blocks`, compiled on the
machine by `build`)."""
