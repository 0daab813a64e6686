"""What is measured on this machine, once per setting and cached: kernel choices, the decode
cost profile, what batched rows cost, and the timing they are all taken with."""
