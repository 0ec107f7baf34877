"""omniloop.web."""
