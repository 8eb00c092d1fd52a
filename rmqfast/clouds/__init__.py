"""Remote clouds: Remoting client for other clusters, online-consumer detection."""
