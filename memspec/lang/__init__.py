"""lang"""
