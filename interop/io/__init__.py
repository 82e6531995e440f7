"""File formats read and written without the frameworks that made them."""
