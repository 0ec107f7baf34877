"""omniloop.agents."""
