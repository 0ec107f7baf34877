"""omniloop.rewards."""
