"""The demos the command line runs: the shapes world, real photographs, the question world."""
