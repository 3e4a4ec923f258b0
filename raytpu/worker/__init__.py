"""The worker side: the one entry every worker starts in, the training loop and what it uses."""
