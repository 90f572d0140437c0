"""Who may do what (pure, standard library only): tenants, the admin token, storage roots, checkpoint
directories, the checkpoint signing key, quotas.
"""
