"""syncwise.compress"""
