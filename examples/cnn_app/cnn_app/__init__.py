"""A Flower app with its own small CNN and image loader, trained in the shuffle model with shuffledp."""
