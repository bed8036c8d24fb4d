"""memory_estimator: will this model train on these accelerators, and how?"""
