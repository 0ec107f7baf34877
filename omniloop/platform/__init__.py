"""omniloop.platform."""
