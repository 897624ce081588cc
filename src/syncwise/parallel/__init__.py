"""syncwise.parallel"""
