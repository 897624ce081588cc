"""syncwise.metrics"""
