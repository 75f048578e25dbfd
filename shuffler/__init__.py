"""shuffledp: shuffler package."""
