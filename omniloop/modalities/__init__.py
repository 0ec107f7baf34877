"""omniloop.modalities."""
