"""The Tunix adapter (``jsparse.tunix``); nothing in the core imports it."""
