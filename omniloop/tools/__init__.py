"""omniloop.tools."""
