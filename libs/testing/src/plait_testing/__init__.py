"""Contract test kits: reusable checks that an implementation honours its protocol."""
