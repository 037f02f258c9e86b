"""Model families the engine serves."""
