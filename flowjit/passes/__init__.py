"""Graph passes (`Graph -> Graph`), registered by kebab-case name, and the pipeline runner."""
