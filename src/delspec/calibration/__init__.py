"""Exit adapters trained on the model's own generations (`delspec calibrate`): above decoding,
whose `generate` makes their training data; the adapters themselves live in drafting/."""
