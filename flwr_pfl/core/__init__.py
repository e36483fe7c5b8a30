"""Each algorithm's mathematics as plain functions on arrays and tensors, free of Flower."""
