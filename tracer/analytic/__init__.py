"""analytic"""
