"""Python client, playback-buffer model, load test and the browser player's static files."""
