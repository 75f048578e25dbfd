"""shuffledp: server package."""
