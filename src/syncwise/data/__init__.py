"""syncwise.data"""
