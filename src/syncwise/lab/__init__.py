"""syncwise.lab"""
