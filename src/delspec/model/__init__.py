"""The model: architectures, the layer-addressable transformer and what it is made of.
Nothing about drafting."""
