"""A small classifier of sklearn's handwritten digits (8x8 images, 10 classes), as a trainer recipe."""
