"""What the service sends beyond its database: task messages to the workers and the live bus."""
