print("Hello, wrold")
