"""Private, stdlib-only helpers shared by every nbtools package."""
