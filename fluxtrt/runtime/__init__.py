"""The thin runtime: executors behind one interface, FLUX math, and the text-to-image pipeline."""
