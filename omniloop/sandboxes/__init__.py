"""omniloop.sandboxes."""
