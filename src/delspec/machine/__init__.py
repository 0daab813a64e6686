"""What is measured on this machine: kernel choices and timing."""
