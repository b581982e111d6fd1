"""A feature draft (EAGLE-3 style): one decoder layer reading the target's hidden states."""
