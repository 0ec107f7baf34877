"""omniloop.inference."""
