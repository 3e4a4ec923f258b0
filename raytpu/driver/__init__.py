"""The driver side: commands that check, prepare and start runs (never touching a device)."""
