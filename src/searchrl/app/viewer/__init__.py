"""`searchrl view`: a static HTML viewer of evaluations, paired comparisons and training samples."""
