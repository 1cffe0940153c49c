"""What runs outside the ranks and starts them. Depends on ``scaleout``; never the other way round."""
