"""omniloop.trainer."""
